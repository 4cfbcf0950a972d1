"""The pytest plugin of the GPU performance regression gate."""
