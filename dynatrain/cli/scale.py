"""``dynatrain scale``: ask a running job to change its device count or layout.

    dynatrain scale --endpoint HOST:PORT (--devices N | --layout SPEC) [--wait] [--token TOKEN] [--timeout S]

The job's control server (``dynatrain.signals.control_server.ControlServer``) answers
``{"accepted": ..., "reason": ...}``, which is printed. Exit status: 0 accepted, 1 refused by the job, 2 bad arguments or no answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from dynatrain.settings import TOKEN_ENV, explicit_or_env

HELP = "ask a running job to scale to N devices or to a layout (through its control endpoint)"


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--endpoint", required=True, metavar="HOST:PORT", help="the job's control endpoint")
    parser.add_argument("--token", default=None,
                        help=f"the job's control token; default: ${TOKEN_ENV} (prefer it: arguments are visible to "
                             f"other users in the process list)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--devices", type=int, metavar="N", help="run on N devices")
    target.add_argument("--layout", metavar="SPEC", help="run on this layout, e.g. dp_shard=2,tp=2")
    parser.add_argument("--wait", action="store_true",
                        help="for a larger target: hold training at the next step boundary until the joiners are "
                             "ready, instead of training on while they start")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default 10)")
    parser.set_defaults(run=run)
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``scale`` on an argparse subparsers object."""
    return configure(subparsers.add_parser("scale", help=HELP, description=__doc__,
                                           formatter_class=argparse.RawDescriptionHelpFormatter))


def _url(endpoint: str) -> str:
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--endpoint {endpoint!r} is not HOST:PORT (e.g. 127.0.0.1:8765, [::1]:8765)")
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/scale"


def post(endpoint: str, token: str, payload: dict, timeout: float = 10.0) -> tuple[int, dict]:
    """(HTTP status, JSON answer). Raises ConnectionError when nothing usable comes back."""
    request = urllib.request.Request(
        _url(endpoint), data=json.dumps(payload).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    # No proxy: the token must go straight to the job, never through a proxy taken from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, _answer(response.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, _answer(err.read())
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConnectionError(f"no answer from {endpoint}: {reason}") from None


def _answer(body: bytes) -> dict:
    try:
        answer = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ConnectionError(f"the endpoint did not answer JSON: {body[:200]!r}") from None
    if not isinstance(answer, dict) or "accepted" not in answer:
        raise ConnectionError(f"the endpoint's answer is not a dynatrain control answer: {answer!r}")
    return answer


def run(args: argparse.Namespace) -> int:
    token = explicit_or_env(args.token or None, TOKEN_ENV)
    if not token:
        print(f"dynatrain scale: error: no token: pass --token or set {TOKEN_ENV}", file=sys.stderr)
        return 2
    payload = {"devices": args.devices} if args.devices is not None else {"layout": args.layout}
    if args.wait:
        payload["wait"] = True
    try:
        status, answer = post(args.endpoint, token, payload, args.timeout)
    except (ValueError, ConnectionError) as err:
        print(f"dynatrain scale: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0 if status == 200 and answer.get("accepted") is True else 1


def main(argv: list[str] | None = None) -> int:
    parser = configure(argparse.ArgumentParser(prog="dynatrain scale", description=HELP))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
