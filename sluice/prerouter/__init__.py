"""Next-layer expert prediction for prefetching: `predict` (the router-based and learned prerouters the model calls).
Fitting the learned heads (`sluice prerouter fit`) records a loaded model's routing: tools/prerouter_fit.py."""
