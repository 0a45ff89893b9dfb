"""The job's services, below every role: the job store and its key sequences, the watchdog,
the roster of engines, the rank layout and placement (cores, GPUs, allocator, oneDNN), and the
per-rank set-up (setup.py). Imports no role: what a role must add (clean-ups, log quieting)
is handed in by launch/."""
