"""Runs that heal: heartbeats and hung ranks named (`heartbeat.py`), in-job restarts and the
guard against repeating the same failure (`restarts.py`), stragglers (`stragglers.py`), stop
signals (`preemption.py`), a lost node's shrink and grow-back (`elastic.py`), out-of-memory
reports (`oom.py`), non-finite and spiking losses
(`guard.py`, `spikes.py`) and the testing hooks that inject each fault (`faults.py`)."""
