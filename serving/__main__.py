"""``python -m serving [--host H] [--port P]``: the serving process (``serving.server``), configured by
the inference settings (``serving.config``), the API pointing at it with ``inference_server_url``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from serving.config import get_serving_settings, server_token

log = logging.getLogger("serving")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = get_serving_settings()
    try:
        server_token(settings)  # before the ML stack is imported: a missing token is refused at once
    except ValueError as e:
        print(f"serving: {e}", file=sys.stderr)
        return 2
    from serving.server import create_app

    app = create_app(settings)
    import uvicorn

    log.info("serving process on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http="h11", lifespan="on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
