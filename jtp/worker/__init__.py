"""The device side: the model runner (params, cache, the jitted step) and on-device sampling."""
