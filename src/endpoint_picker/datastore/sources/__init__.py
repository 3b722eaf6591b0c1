"""Sources feed the datastore whole ``ClusterState`` values: the pool file, later Kubernetes."""
