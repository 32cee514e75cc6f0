"""Speculative decoding: proposers guess a running sequence's next tokens on the host, the step
verifies them in one pass (a decode row of k + 1 query tokens over the cached prefix), and the
rejection rule keeps what the model would have sampled (greedy: the same tokens). Its settings:
`treeserve.speculative_config.SpeculativeConfig`."""
