"""The ext_proc edge: the only package that imports Envoy's protos."""
