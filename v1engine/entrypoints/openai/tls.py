"""HTTPS for the API server (vLLM's flags): `--ssl-keyfile` and `--ssl-certfile` serve TLS, and
`--ssl-ca-certs` with `--ssl-cert-reqs 2` asks clients for a certificate that CA signed (mutual
TLS). uvicorn builds the server's context from the files; `check_tls_args` builds one first,
before the engine starts, so a missing or unreadable file stops start-up naming its flag."""

from __future__ import annotations

import argparse
import ssl
from typing import Any


def add_cli_args(group: Any) -> None:
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key file: serve HTTPS")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate (chain) file")
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates that client certificates must chain to",
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=[int(mode) for mode in ssl.VerifyMode],
        default=int(ssl.CERT_NONE),
        help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)",
    )


def check_tls_args(args: argparse.Namespace) -> None:
    """Raises ValueError, naming the flag, for half a key pair, unreadable files, a key that
    does not match its certificate, or client certificates required without a CA to check
    them against."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS")
    if args.ssl_keyfile is None:
        for flag, given in (
            ("--ssl-ca-certs", args.ssl_ca_certs is not None),
            ("--ssl-cert-reqs", args.ssl_cert_reqs != ssl.CERT_NONE),
        ):
            if given:
                raise ValueError(f"{flag} needs HTTPS: give --ssl-keyfile and --ssl-certfile")
        return
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs asks clients for certificates: give --ssl-ca-certs")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"cannot load --ssl-certfile {args.ssl_certfile!r} with --ssl-keyfile "
            f"{args.ssl_keyfile!r}: {e}"
        ) from e
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot load --ssl-ca-certs {args.ssl_ca_certs!r}: {e}") from e


def uvicorn_tls_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS arguments (none without --ssl-keyfile)."""
    if args.ssl_keyfile is None:
        return {}
    return {
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }
