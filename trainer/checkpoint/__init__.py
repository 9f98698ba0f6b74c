"""Distributed Checkpoint saves and resumes (`checkpointer.py`: what a checkpoint holds, when it
is written, which step a run resumes from) and their integrity manifest (`integrity.py`)."""
