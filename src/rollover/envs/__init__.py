"""Environments for multi-turn and tool-using episodes, and the sandbox their tools run code in."""
