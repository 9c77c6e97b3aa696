"""HTTPS (vLLM's `--ssl-*` flags) on a real `python -m v1engine.serve`: the real `openai` client
talks to it over TLS with the test certificate (certs/: a self-signed EC key for localhost and
127.0.0.1, valid 2000-2100, so any clock accepts it); plain HTTP and clients that do not trust the
certificate get nowhere; with `--ssl-cert-reqs 2` only clients presenting a certificate the CA
signed are served (mutual TLS); and bad flag combinations stop start-up with exit status 2
before any engine starts, naming the flag.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import ROOT, serve_module
from tests.timeouts import scaled
from v1engine.entrypoints.openai.tls import check_tls_args
from v1engine.serve import make_arg_parser

CERTS = os.path.join(os.path.dirname(__file__), "certs")
CERT, KEY = os.path.join(CERTS, "server.crt"), os.path.join(CERTS, "server.key")
MODEL = "tiny"
TLS_ARGS = ("--ssl-keyfile", KEY, "--ssl-certfile", CERT)


def client_context(with_certificate: bool) -> ssl.SSLContext:
    """Trusts the test certificate; presents it as the client's own when asked to."""
    context = ssl.create_default_context(cafile=CERT)
    if with_certificate:
        context.load_cert_chain(CERT, KEY)
    return context


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    args = ("--served-model-name", MODEL, *TLS_ARGS)
    verify = client_context(with_certificate=False)
    yield from serve_module(tiny_model, tmp_path_factory, *args, tp=1, verify=verify)


def test_the_openai_client_is_served_over_https(server):
    assert server.url.startswith("https://")
    with httpx.Client(verify=server.verify, timeout=scaled(60)) as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", http_client=http)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].finish_reason in ("stop", "length")


def test_plain_http_and_untrusting_clients_get_nowhere(server):
    plain = server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=scaled(10))
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/health", timeout=scaled(10))  # the system's CAs only
    assert httpx.get(server.url + "/health", verify=server.verify).status_code == 200


def test_mutual_tls_serves_only_clients_with_a_certificate(tiny_model, tmp_path_factory):
    args = ("--served-model-name", MODEL, *TLS_ARGS, "--ssl-ca-certs", CERT, "--ssl-cert-reqs", "2")
    verify = client_context(with_certificate=True)
    for remote in serve_module(tiny_model, tmp_path_factory, *args, tp=1, verify=verify):
        url = remote.url + "/v1/models"
        assert httpx.get(url, verify=verify).json()["data"][0]["id"] == MODEL
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=client_context(with_certificate=False), timeout=scaled(10))


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--ssl-keyfile", KEY], "--ssl-keyfile and --ssl-certfile go together"),
        (
            ["--ssl-keyfile", KEY, "--ssl-certfile", "/nonexistent.pem"],
            "cannot load --ssl-certfile",
        ),
        (["--ssl-keyfile", CERT, "--ssl-certfile", CERT], "cannot load --ssl-certfile"),
        ([*TLS_ARGS, "--ssl-cert-reqs", "2"], "give --ssl-ca-certs"),
        ([*TLS_ARGS, "--ssl-ca-certs", KEY], "cannot load --ssl-ca-certs"),
        (["--ssl-ca-certs", CERT], "--ssl-ca-certs needs HTTPS"),
    ],
)
def test_bad_tls_flags_name_the_flag(flags, error):
    with pytest.raises(ValueError, match=error):
        check_tls_args(make_arg_parser().parse_args(flags))


def test_bad_tls_flags_stop_start_up_before_the_engine(tmp_path):
    # No --model: were the flags not checked first, the default model would start loading.
    command = [sys.executable, "-m", "v1engine.serve", "--port", "0", "--ssl-keyfile", KEY]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 2, done.stderr
    assert "--ssl-keyfile and --ssl-certfile go together" in done.stderr
    assert "Engine ready" not in done.stderr and "Loaded" not in done.stderr
