"""atoll.ops: operating atoll on Prefect: the local stack, deployments, launching and following runs."""
