"""The P-EAGLE / EAGLE-3 drafter: config, Flax module, draft graphs and checkpoint formats.

The drafter never imports the target model: they meet in the speculative decoding code through arrays
only (fused aux hidden states, tokens, positions, and the target's embedding table when it is shared).
"""
