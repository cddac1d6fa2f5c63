"""This machine's processes: who started whom, the reaper that ends them with their parent, and the temp folders
that go with them."""
