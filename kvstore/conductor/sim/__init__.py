"""The discrete-event simulator: N prefill and M decode instances, a global pool, the cost
model, replaying a trace through any `SchedulingPolicy`."""
