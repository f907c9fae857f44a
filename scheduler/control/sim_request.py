"""A simulated request's state (``Req``) and a workload's requests as the simulator draws them
(``draw_requests``): each one's exit layers from its own exit distribution (exit_model.py ``ExitModel``),
and when it reaches the engine through the front end's one-at-a-time queue (``SimConfig.ingress_ms``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.control.exit_model import ExitModel
from scheduler.control.workload import Workload


@dataclass(eq=False)
class Req:
    i: int
    arrival: float
    prompt: int
    out: int
    exits: np.ndarray           # [out] the exit layer of each generated token (index 0: prefill, full depth)
    ready: float = 0.0          # when it leaves the front end's queue and reaches the engine (SimConfig.ingress_ms)
    prefilled: int = 0
    generated: int = 0
    first: float | None = None
    last: float | None = None   # when its latest token reached the client
    end: float | None = None
    predicted: float | None = None
    late: bool = False          # a token was delivered after its due time
    rejected: bool = False
    shed: bool = False          # refused while waiting: its TTFT deadline passed (SimConfig.shed_late)
    audit: bool = False         # the host's own audit request: no client, no SLA


def draw_requests(workload: Workload, exits: ExitModel, seed: int, ingress_ms: float) -> list[Req]:
    """``workload``'s requests in arrival order, each with its exit layers drawn (the prefill's token at full
    depth) and its time to reach the engine behind the front end's FIFO queue of ``ingress_ms`` per request."""
    w = workload
    rng = np.random.default_rng(seed)
    layers = np.asarray(exits.layers)
    reqs = []
    for i in range(len(w)):
        n = int(w.output_tokens[i])
        ex = rng.choice(layers, size=n, p=exits.request_probs(rng))
        ex[0] = layers[-1]
        reqs.append(Req(i, float(w.arrival_s[i]), int(w.prompt_tokens[i]), n, ex))
    ingress, free = ingress_ms / 1e3, -np.inf
    for r in reqs:  # the front end serves one request at a time, in arrival order
        r.ready = free = max(r.arrival, free) + ingress
    return reqs
