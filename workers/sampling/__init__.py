"""Turning logits into tokens: the sampler, prompt logprobs, guided decoding (guides, their compiler and its
child process)."""
