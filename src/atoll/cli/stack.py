"""``atoll up``, ``atoll deploy`` and ``atoll demo``: the local stack (Prefect server, workers),
atoll's deployments on work pools, and the demo that runs both and trains."""

from __future__ import annotations

import argparse
import sys

from atoll.cli.flags import add_option_flag, field_flag, kv


def add_up(sub: argparse._SubParsersAction) -> None:
    from atoll.ops.defaults import DEFAULT_POOLS, DEFAULT_PORT

    p = sub.add_parser("up", help="start the local stack: Prefect server (SQLite or PostgreSQL) + a process "
                       "worker per pool")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="server port (default %(default)s, or a free one)")
    p.add_argument("--pools", nargs="+", default=list(DEFAULT_POOLS), help="local process pools (default: %(default)s)")
    p.add_argument("--home", default=None, help="PREFECT_HOME for the stack (default: your Prefect home)")
    p.add_argument("--no-deploy", action="store_true", help="do not register atoll's deployments")
    p.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite",
                   help="the server's database: SQLite in its home, or a private PostgreSQL cluster started "
                   "under <home>/postgres and stopped with the stack (needs the server binaries: "
                   "apt-get install postgresql, or ATOLL_POSTGRES_BIN)")
    p.add_argument("--database-url", default=None, metavar="URL",
                   help="run the server on a database you run yourself: postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB")
    p.set_defaults(handler=_up)


def add_deploy(sub: argparse._SubParsersAction) -> None:
    from atoll.ops.defaults import DEFAULT_POOLS

    p = sub.add_parser("deploy", help="register the training-run deployment and one learner deployment per pool")
    p.add_argument("--pools", nargs="+", default=list(DEFAULT_POOLS), help="learner pools (default: %(default)s)")
    p.add_argument("--control-pool", default=None, help="pool of the training run (default: the first pool)")
    p.add_argument("--create-pools", action="store_true", help="create missing pools as process pools")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="env for every job (not credentials: see --secret-block)")
    p.add_argument("--image", default=None,
                   help="image for the learner deployments (and the training run, if its pool takes an image)")
    p.add_argument("--job-variable", action="append", default=[], metavar="KEY=VALUE",
                   help="job variable of every learner deployment, repeatable; JSON values are parsed "
                        "(gpu_count=2, node_selector='{\"k\": \"v\"}'); env.NAME=VALUE adds one env var")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="learner slots per pool (e.g. GPUs / gpu_count): sets each learner pool's concurrency limit")
    p.add_argument("--secret-block", default=None, metavar="NAME",
                   help="Prefect Secret block with the bucket credentials (a JSON object of env vars); "
                        "jobs get only its name, as ATOLL_SECRET_BLOCK")
    p.add_argument("--insecure-env", action="store_true",
                   help="allow credential-looking --env/--job-variable values (local test servers only)")
    p.set_defaults(handler=_deploy)


def add_demo(sub: argparse._SubParsersAction) -> None:
    from atoll.ops.defaults import DEFAULT_PORT, DEMO_DIR
    from atoll.runs.options import TrainingRunOptions

    p = sub.add_parser("demo", help="what `make demo` runs: local stack, deploy, train the demo preset")
    p.add_argument("--dir", default=DEMO_DIR, help="where the bucket, Prefect home and logs go (default %(default)s)")
    for name in ("learners", "rounds"):
        add_option_flag(p, field_flag(TrainingRunOptions, name))
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="server port (default %(default)s, or a free one)")
    p.add_argument("--keep-up", action="store_true", help="keep the stack up after training until Ctrl-C")
    p.set_defaults(handler=_demo)


def _up(args: argparse.Namespace) -> int:
    from atoll.ops.stack import run_stack_forever

    return run_stack_forever(port=args.port, pools=args.pools, home=args.home, deploy=not args.no_deploy,
                             database=args.database, database_url=args.database_url)


def _deploy(args: argparse.Namespace) -> int:
    from atoll.ops.deploy import deploy_all, ensure_pools

    if args.create_pools:
        ensure_pools(args.pools)
    if args.image or args.job_variable or args.concurrency is not None or args.secret_block:
        return _deploy_images(args)
    for name, dep_id in deploy_all(args.pools, control_pool=args.control_pool, env=kv(args.env)).items():
        print(f"deployed {name} ({dep_id})")
    return 0


def _deploy_images(args: argparse.Namespace) -> int:
    """`atoll deploy --image IMG --job-variable k=v ... --concurrency N --secret-block NAME`."""
    from atoll.flows.credentials import SECRET_BLOCK_ENV
    from atoll.ops.deploy import (
        deploy_all,
        parse_job_variables,
        plaintext_credentials,
        pool_variables,
        set_pool_concurrency,
    )

    env = kv(args.env)
    jv = parse_job_variables(args.job_variable)
    if args.image:
        jv["image"] = args.image
    leaked = plaintext_credentials({**jv, "env": {**env, **jv.get("env", {})}})
    if leaked and not args.insecure_env:
        print(f"refusing to put {', '.join(leaked)} in job variables (stored and shown in plaintext): put bucket "
              "credentials in a Prefect Secret block (--secret-block NAME) or the pool's secret "
              "(kubernetes: the credentials_secret variable); --insecure-env overrides for local test servers",
              file=sys.stderr)
        return 2
    if args.secret_block:
        env[SECRET_BLOCK_ENV] = args.secret_block
    control = args.control_pool or args.pools[0]
    declared = pool_variables(sorted({*args.pools, control}))
    for pool in args.pools:
        unknown = sorted(set(jv) - declared[pool] - {"env"})
        if unknown:
            print(f"note: pool {pool}'s job template does not declare {', '.join(unknown)} (ignored by its worker)")
    control_jv = {"image": args.image} if args.image and "image" in declared[control] else None
    deployed = deploy_all(args.pools, control_pool=control, env=env,
                          pool_job_variables={pool: jv for pool in args.pools}, control_job_variables=control_jv)
    for name, dep_id in deployed.items():
        print(f"deployed {name} ({dep_id})")
    if args.concurrency is not None:
        learner_pools = [p for p in args.pools if p != control]
        limits = set_pool_concurrency(learner_pools, args.concurrency)
        if control in args.pools:  # the training run and the supervisor each hold a slot of their pool
            limits.update(set_pool_concurrency([control], args.concurrency + 2))
            print(f"note: the training run and the supervisor share pool {control} with learners: its limit is "
                  f"{args.concurrency} + 2; a separate CPU control pool (--control-pool) keeps every slot for learners")
        for pool, limit in limits.items():
            print(f"work pool {pool}: concurrency limit {limit}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from atoll.ops.client import run_demo

    return run_demo(args.dir, learners=args.learners, rounds=args.rounds, port=args.port, keep_up=args.keep_up)
