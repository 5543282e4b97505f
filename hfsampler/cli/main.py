"""The command line: `hfsampler run`, `check-config` and `fields`.

Flags override the config file. A user's mistake is one line on stderr naming the key and the fix,
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NoReturn

from hfsampler import __version__, logs
from hfsampler import fields as catalogue
from hfsampler.cli.aio import run_async
from hfsampler.config.flags import add_sampling_flags, config_from_args
from hfsampler.config.loader import load_file
from hfsampler.config.settings import Config
from hfsampler.config.webconfig import load_web_config
from hfsampler.errors import ConfigError, HfsamplerError
from hfsampler.logs import one_line
from hfsampler.sampling.plan import build_run

log = logging.getLogger("hfsampler")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell shows for a process SIGPIPE ended

Handler = Callable[[argparse.Namespace], int]

# The commands that have a module of their own here: each has ``register(subparsers) -> dict[str,
# Handler]`` next to the calls it makes.
COMMAND_MODULES = ("record", "report", "replay", "probe")
OWN_COMMANDS = ("run", "check-config", "fields")  # defined here


def command_modules(command: str | None = None) -> tuple[ModuleType, ...]:
    """The modules of ``command`` alone (none for one defined here), else of every command.

    Only the command asked for is imported: `report` and `record` need no HTTP client, and
    importing every command's stack cost each of them more than half a second of startup.
    """
    if command in OWN_COMMANDS:
        return ()
    if command == "record":
        from hfsampler.cli import record

        return (record,)
    if command == "report":
        from hfsampler.cli import report

        return (report,)
    if command == "replay":
        from hfsampler.cli import replay

        return (replay,)
    if command == "probe":
        from hfsampler.cli import probe

        return (probe,)
    from hfsampler.cli import probe, record, replay, report

    return (record, report, replay, probe)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"hfsampler: error: {message}\n")


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    """The parser and, per subcommand, the function that runs it: every subcommand, or of those
    with a module of their own none but ``command`` (the one about to run)."""
    parser = _Parser(
        prog="hfsampler",
        description="Millisecond GPU sampling with window statistics, pushed over Remote-Write.",
    )
    parser.add_argument("--version", action="version", version=f"hfsampler {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="sample GPUs, serve /metrics, push window series")
    add_sampling_flags(run)

    check = sub.add_parser("check-config", help="validate a config file and print it")
    check.add_argument("file", metavar="FILE", nargs="?")
    wording = {"--fields-csv": "a dcgm-exporter counters file: alone, or over FILE's fields_csv",
               "--web-config-file": "a web configuration file: alone, or over FILE's"}  # fmt: skip
    add_sampling_flags(check, ("--fields-csv", "--web-config-file"), wording=wording)

    sub.add_parser("fields", help="list the field catalogue")
    handlers: dict[str, Handler] = {
        "run": cmd_run,
        "check-config": cmd_check_config,
        "fields": cmd_fields,
    }
    for module in command_modules(command):
        handlers.update(module.register(sub))
    return parser, handlers


def cmd_run(args: argparse.Namespace) -> int:
    from hfsampler.export.service import Service

    config = config_from_args(args)
    logs.setup(config.log_level, config.log_format)
    plan = build_run(config)
    if not plan.inventory.devices:
        log.error("the %s source found no GPU", plan.spec.kind)
        return EXIT_FAILURE
    if not plan.inventory.fields:
        log.error("none of the selected fields is supported by these GPUs")
        return EXIT_FAILURE

    def reload() -> Config:
        return config_from_args(args)  # the same files and flags, read again (SIGHUP)

    return run_async(lambda: Service(plan, loader=reload).run())


def cmd_check_config(args: argparse.Namespace) -> int:
    if args.file is None and args.fields_csv is None and not args.web_config_file:
        raise ConfigError(
            "check-config", "nothing to check", "give FILE, --fields-csv or --web-config-file"
        )
    from hfsampler.export.queue_fit import queue_warnings

    config = config_from_args(args, load_file(args.file) if args.file else None)
    fields = config.selected_fields()
    jetson = config.source == "jetson"
    if jetson:  # the fields a Jetson has files for; a per-rail or per-zone one counts once
        fields = tuple(f for f in fields if f.jetson)
    print(f"{args.file or args.fields_csv or args.web_config_file}: OK")
    for warning in config.warnings() + queue_warnings(config):
        print(f"  warning: {one_line(warning)}")
    for line in config.fields_csv.describe() if config.fields_csv is not None else ():
        print(f"  {one_line(line)}")
    listen = "off (no /metrics)" if config.listen is None else one_line(str(config.listen))
    print(f"  source: {config.source}; window {config.window_s:g}s; listen {listen}")
    if config.web_config_file:
        web = load_web_config(config.web_config_file)
        print(f"  web_config_file: {one_line(web.path)}: {one_line(web.describe())}")
    if config.jetson_sysfs_root:
        root = one_line(config.jetson_sysfs_root)
        print(f"  jetson.sysfs_root: {root} (tests only: a Jetson reads /)")
    groups = sorted({f.group for f in fields})
    for g in groups:
        n = sum(f.group == g for f in fields)
        print(
            f"  group {g}: {n} field{'s' if n != 1 else ''} every "
            f"{config.intervals_s[g] * 1e3:g} ms"
        )
    if jetson and any(f.per for f in fields):
        print("  (a per-rail or per-zone field becomes one field per rail or zone found)")
    if config.external_labels:
        labels = one_line(", ".join(f"{k}={v}" for k, v in sorted(config.external_labels.items())))
        print(f"  external labels: {labels}")
    if config.queue_dir:
        print(f"  queue_dir: {one_line(config.queue_dir)}")
    for ep in config.remote_write:
        print(f"  remote_write: {ep.display_url}")
        if ep.auth is not None:
            print(f"    auth: {ep.auth.describe()}")  # never the secret itself
        if ep.relabel:
            print(f"    write_relabel_configs: {len(ep.relabel)} rule(s)")
    return EXIT_OK


def cmd_fields(args: argparse.Namespace) -> int:
    width = max(len(f.name) for f in catalogue.CATALOGUE)
    print(f"{'NAME':<{width}}  {'KIND':<7}  {'GROUP':<5}  {'UNIT':<5}  {'JETSON':<22}  NVML")
    for f in catalogue.CATALOGUE:
        how = f.nvml_field or (f"call:{f.nvml_call}" if f.nvml_call else "-")
        if f.gpm_metric:
            how = f"gpm:{f.gpm_metric} (or DCGM field {f.dcgm_field})"
        if f.nvml_field and f.nvml_call:
            how += f" (fallback call:{f.nvml_call})"
        if f.counted:
            how = f"counted from {', '.join(f.requires)}"
        jetson = (f.jetson or "-") + (f" per {f.per}" if f.per else "")
        if f.opt_in:
            how += " (opt-in: by name or all)"
        print(f"{f.name:<{width}}  {f.kind.value:<7}  {f.group:<5}  {f.unit:<5}  {jetson:<22}  "
              f"{how}")  # fmt: skip
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = words[0] if words and words[0] in (*OWN_COMMANDS, *COMMAND_MODULES) else None
    parser, handlers = build_parser(command)
    args = parser.parse_args(words)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"hfsampler: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `hfsampler fields | head`: what reads us has had enough; quiet, as a process that
        # SIGPIPE ended (Python ignores the signal), and no second error at exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (HfsamplerError, OSError) as exc:
        print(f"hfsampler: error: {one_line(str(exc))}", file=sys.stderr)  # once, not logged too
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_OK
