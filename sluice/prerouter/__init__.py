"""Next-layer expert prediction for prefetching: `predict` (the router-based and learned prerouters the model calls)
and `fit` (recording routing and fitting the learned heads, `sluice prerouter fit`)."""
