"""tfmulti: data-parallel Keras training with model_deploy towers."""
