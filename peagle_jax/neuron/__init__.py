"""Export for Neuron and TPU, the Neuron lint and the roofline planner (``python -m peagle_jax.neuron``)."""
