"""Is the Hugging Face hub there? One quick check for data sets (fgrpo.rollout.data) and models (fgrpo.learner.model),
so that a machine without a network fails in seconds, or reads the local cache, instead of waiting on timeouts."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
import urllib.request

HUB_PROBE_TIMEOUT_S = 3.0
_TRUE_ENV_VALUES = {"1", "ON", "YES", "TRUE"}
OFFLINE_ENV_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_env_var() -> str | None:
    """The variable asking Hugging Face libraries to stay offline, if one is set (read at call time)."""
    for var in OFFLINE_ENV_VARS:
        if os.environ.get(var, "").strip().upper() in _TRUE_ENV_VALUES:
            return var
    return None


def can_connect(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout_s``, DNS lookup included.

    The attempt runs in a daemon thread because ``getaddrinfo`` has no timeout of its own.
    """
    outcome: list[bool] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    prober = threading.Thread(target=attempt, name="fgrpo-hub-probe", daemon=True)
    prober.start()
    prober.join(timeout_s)
    return bool(outcome and outcome[0])


def hub_reachable(endpoint: str | None = None, *, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """A quick TCP check of the hub (``HF_ENDPOINT``, default huggingface.co), or of its HTTPS proxy."""
    try:
        url = urllib.parse.urlsplit(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        proxy = urllib.request.getproxies().get(url.scheme)
        if host and proxy and not urllib.request.proxy_bypass(host):
            proxy_url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            if proxy_url.hostname:
                host, port = proxy_url.hostname, proxy_url.port or (443 if proxy_url.scheme == "https" else 80)
    except ValueError:  # a malformed URL or port
        return False
    return bool(host) and can_connect(host, port, timeout_s)


@contextlib.contextmanager
def datasets_offline(datasets_module):
    """Put ``datasets`` (and huggingface_hub) in offline mode for one load, so it reads its cache
    instead of waiting on network timeouts. Process-wide while it lasts: not thread-safe."""
    import huggingface_hub.constants as hub_constants

    saved = (datasets_module.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets_module.config.HF_HUB_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets_module.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
