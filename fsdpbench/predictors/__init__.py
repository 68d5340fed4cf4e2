"""The predictors: analytic (memory_model), traced (fake tensors), emulated (one real rank), comm model."""
