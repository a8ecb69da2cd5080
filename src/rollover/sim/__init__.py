"""The cluster simulator (`rollover simulate`, docs/simulator.md).

- `config.py`: its config (a training config plus the `simulate` section) and loader;
- `costs.py`: the cost models (engine step, training step, weight dissemination) and profiles;
- `workload.py`: simulated prompts, response lengths and rewards;
- `core.py`: rollout workers doing continuous batching as events on a virtual clock;
- `engine.py`: `SimEngine`, the engine contract over that core;
- `run.py`: rollover's own schedulers (sync, APRIL, async) driving it, and the report;
- `report.py`: the report as text, JSON and a Gantt chart;
- `fast.py`, `fleet.py`, `route.py`: the fast path (`simulate.fast`): the same policies with every
  worker a row of numpy arrays, and the router's rule (numba-compiled when numba is installed).
"""
