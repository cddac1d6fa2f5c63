"""This machine's processes: who started whom, the reaper that ends them with their parent, the temp folders
that go with them, and the memory a process keeps for reuse."""
