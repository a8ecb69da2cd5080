"""What TorchEngine does for speed on a CPU, kept apart from the engine's core (sequences,
scheduler, runner): C kernels compiled at first use (`native`, `kernels.c`), MKL-packed weights
for decode batches (`weight_packs`), handing a waiting thread's OpenMP workers back
(`openmp`), and keeping the thread count to the cores other processes leave free (`share`)."""
