"""Every vLLM internal Relay touches, in one package. Detects features, not versions; fails closed.

    engine.py   the engine adapter: build an AsyncLLM, sample token-in/token-out, pause/resume around a
                weight load, set the weight version, RPC to the workers. `check_capabilities` refuses an
                engine that lacks what the config needs (e.g. pausing generation for a weight load)
    replica_engine.py  a rollout replica's engine arguments, environment and requests, from the run's config:
                shared by Serve's replicas and `python -m app eval`'s in-process engine
    worker.py   the worker extension vLLM mixes into each worker process (`worker_extension_cls`): join
                the weight group and load pushed buckets through a transport of app/weights/

Nothing here is imported by app/ at module import time outside the rollout replica: vLLM is a heavy import.
"""
