"""The ``kvcore`` command: ``plugins``, ``demo``, ``bench``, ``keygen`` and ``--version``.

Nothing plugin-related runs at import time; ``kvcore plugins`` works even when
a plugin is broken (it reports the error instead of crashing).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _version_text() -> str:
    from kvcore import __version__
    from kvcore.extension.plugins import make_plugin_manager

    lines = [f"kvcore {__version__}"]
    pm = make_plugin_manager()
    ext = [r for r in pm.records if not r.builtin]
    if ext:
        lines.append("registered plugins:")
        for r in ext:
            lines.append(f"  {r.name}: {r.dist_label} ({r.status})")
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    """List plugins, what they provide and any error."""
    from kvcore.extension.plugins import make_plugin_manager

    pm = make_plugin_manager()
    _ = pm.registries  # run the registration hooks so "provides" and register-phase failures are filled
    records = pm.records
    if not args.all:
        records = [r for r in records if not r.builtin] + [r for r in records if r.builtin]
    broken = [r for r in records if r.status in ("failed", "api_mismatch")]
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="kvcore plugins", show_lines=False)
        for col in ("NAME", "DISTRIBUTION", "VERSION", "STATUS", "PROVIDES", "ERROR"):
            table.add_column(col, overflow="fold")
        for r in records:
            provides = "; ".join(f"{k.replace('_', ' ')}: {', '.join(v)}" for k, v in r.provides.items())
            status = {"loaded": "[green]loaded[/]", "blocked": "[yellow]blocked[/]"}.get(
                r.status, f"[red]{r.status}[/]"
            )
            table.add_row(
                r.name,
                "kvcore (built-in)" if r.builtin else (r.dist or "-"),
                r.version or "-",
                status,
                provides or "-",
                r.error or "",
            )
        Console(width=max(100, Console().width)).print(table)
        if not records:
            print("no plugins installed")
    if args.check and broken:
        print(f"{len(broken)} plugin(s) broken: {', '.join(r.name for r in broken)}", file=sys.stderr)
        return 1
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    """Write a CurveZMQ key pair for one rank (or a whole deployment) and print the configuration that uses it."""
    from kvcore.control.auth import write_key_pair
    from kvcore.errors import ConfigError

    try:
        pub, sec = write_key_pair(args.dir, args.name)
    except (ConfigError, OSError) as exc:
        print(f"kvcore keygen: {exc}", file=sys.stderr)
        return 1
    import zmq.auth

    public, _ = zmq.auth.load_certificate(pub)
    print(f"wrote {sec} (secret, mode 0600: keep it on this host only)")
    print(f"wrote {pub} (public: copy it into the allowed-keys directory of every peer that must accept this rank)")
    print(f"public key: {public.decode()}")
    print()
    print("TOML ([kvcore] table of the configuration file):")
    print(f'  auth_key_file = "{sec}"')
    print('  auth_allowed_keys_dir = "/path/to/allowed"   # *.key files of the peers this rank accepts')
    print(f'  # auth_server_key = "{public.decode()}"  # what peers put here when this key pair is shared')
    print("environment:")
    print(f"  KVCORE_AUTH_KEY_FILE={sec}")
    print("  KVCORE_AUTH_ALLOWED_KEYS_DIR=/path/to/allowed")
    print("One key pair shared by every rank needs no allow-list: a rank always accepts its own public key.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcore", description="KV-cache transfer for disaggregated LLM serving (prefill -> decode)."
    )
    parser.add_argument("--version", action="store_true", help="print kvcore's and the installed plugins' versions")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list installed plugins, what they provide and their errors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--check", action="store_true", help="exit 1 when a plugin failed to load")
    p.add_argument("--all", action="store_true", help="(kept for compatibility; built-ins are always listed)")
    p.set_defaults(func=cmd_plugins)

    k = sub.add_parser("keygen", help="write a CurveZMQ key pair for control-plane authentication")
    k.add_argument("--dir", default=".", help="directory to write NAME.key and NAME.key_secret into (default: .)")
    k.add_argument("--name", default="kvcore", help="file name stem (default: kvcore)")
    k.set_defaults(func=cmd_keygen)

    try:
        from kvcore.tools import demo

        demo.add_parser(sub)
    except ImportError:  # pragma: no cover - during development only
        pass
    try:
        from kvcore.tools import bench

        bench.add_parser(sub)
    except ImportError:  # pragma: no cover
        pass
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_version_text())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
