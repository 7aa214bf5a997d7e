"""Seeing inside a run: what each rank did, as it did it.

One :class:`~ferrogrpc.observe.observer.Observer` per peer. The engine tells
it of every collective (called, started, ended: one path, see [Note: one
path per collective] in runtime/engine.py), and the wrappers of their waits
(spans: a DDP bucket's wait, an FSDP unit's gather). Always on:

- the flight recorder (flight.py): the last collectives in a bounded ring,
  dumped to ``FERROGRPC_FLIGHT_DIR`` when the rank breaks; ``ferrogrpc
  diagnose DIR`` (diagnose.py) reads the dumps and names the culprit.

Off unless asked for, each a *sink* the observer calls:

- metrics (metrics.py): Prometheus, ``metrics_port`` /
  ``FERROGRPC_METRICS_PORT``;
- the trace (trace.py): Chrome/Perfetto JSON per rank, ``FERROGRPC_TRACE``;
  ``ferrogrpc trace merge`` aligns the ranks' clocks into one file;
- structured logs (logs.py): ``logging``, with a JSON formatter.
"""
