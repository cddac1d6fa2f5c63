"""The data model on the ground floor: traces, the channels algorithms set on them, and the training samples
they become. These modules import nothing from trace_rl but `names` and `errors`; every layer above reads them."""
