"""The `remote` runtime: a model served by other V2 servers (Triton, MLServer, another
infergate), reached over HTTP from the gateway process itself.

    config.py    model.toml's [remote] table
    outlier.py   Envoy's outlier detection (consecutive 5xx, ejection times, max percent)
    health.py    active health checks on /v2/health/ready (thresholds)
    balancer.py  endpoints, least-request power-of-two-choices, the retry budget
    http1.py     a lean HTTP/1.1 keep-alive pool per endpoint (the pass-through's)
    client.py    RemotePool: the pools, balancer and detectors; forward with retries
    served.py    RemoteServedVersion: a ServedVersion without workers

No tensor is decoded on the pass-through path: the body and its
Inference-Header-Content-Length go upstream unchanged.
"""
