"""Reception's dispatch: the dispatcher (`dispatcher.py`) takes queued jobs while engines have room
and runs each through the saga (`pipeline.py`: plan → place → generate → finalize) over the other
stages (`stages.py`); a job's turn policy (`turns.py`) is what makes a session's turn differ from a
plain job."""
