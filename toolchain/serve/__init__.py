"""`trtbuild serve`: an OpenAI-compatible HTTP server over the in-flight batching runtime.

The constants here are the server's public surface that deployments depend on (probes, scrape path, port); the
Kubernetes example in examples/deploy/ is tested against them.
"""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
HEALTH_PATH = "/health"  # liveness: the process answers and the step loop's heartbeat is recent
READY_PATH = "/ready"  # readiness: engine verified, loaded and warmed up; 503 before that and while draining
HEALTH_GENERATE_PATH = "/health/generate"  # one real token through the engine
METRICS_PATH = "/metrics"  # Prometheus text format, vLLM's metric names
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # SIGTERM -> stop admitting, let in-flight requests finish this long, exit 0
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_QUEUE = 256
ENGINE_HEADER = "x-trtbuild-engine"  # every response: the engine's manifest sha256
EXIT_ENGINE_FAILED = 3  # `trtbuild serve`'s exit status when a rank of its engine failed (dead or timed out)
