"""This machine's processes: who started whom, and the reaper that ends them with their parent."""
