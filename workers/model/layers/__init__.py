"""The blocks an architecture file assembles: RMSNorm (norm.py), self-attention over the paged KV cache
(attention.py), the gated MLP (mlp.py), the vocabulary-parallel embedding and LM head (embedding.py).

The weights are plain tensors (no nn.Module): each block loads its own (this rank's slice under tensor
parallelism, through weights.Weights) and runs on the op set, which it takes at every call rather than
holding: the op set is the model's attribute, and a probe may swap it between runs (benchmarks/)."""
