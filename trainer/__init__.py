"""Synchronous data-parallel MNIST training on a TensorFlow ps cluster."""
