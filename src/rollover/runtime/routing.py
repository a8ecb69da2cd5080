"""Where `RayEngine` sends a request: least outstanding tokens, with prompt-prefix affinity."""

from __future__ import annotations

import collections
from operator import attrgetter

from rollover.types import Request

PREFIX_TOKENS = 64  # the prompt prefix that names a request's cache home
MAX_PREFIXES = 100_000  # prefixes remembered (least recently used forgotten)
_LOAD = attrgetter("load")


class Router:
    """A fresh request goes to the worker that served its prompt prefix (a group's other
    samples, an episode's earlier turns) unless that worker owes more than `slack` tokens
    beyond the least-loaded worker; otherwise, and for resumed requests, to the least-loaded.
    Workers are anything with `index` and `load` (tokens still owed); the caller holds the
    lock that guards their loads."""

    def __init__(self, slack: int):
        self.slack = slack
        self._home: collections.OrderedDict = collections.OrderedDict()  # prefix -> worker index

    def pick(self, req: Request, workers: list):
        best = min(workers, key=_LOAD)
        if req.response_ids:  # a resumed request: any worker recomputes its prefix
            return best
        key = hash(tuple(req.prompt_ids[:PREFIX_TOKENS]))
        home = self._home.get(key)
        pick = best
        if home is not None:
            held = workers[home] if home < len(workers) and workers[home].index == home else None
            if held is None:  # workers listed out of index order
                held = next((w for w in workers if w.index == home), None)
            if held is not None and held.load <= best.load + self.slack:
                pick = held
        self._home[key] = pick.index
        self._home.move_to_end(key)
        if len(self._home) > MAX_PREFIXES:
            self._home.popitem(last=False)
        return pick
