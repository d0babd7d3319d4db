"""Shell completion for npuctl, generated from its argparse parser (`npuctl completion bash|zsh`).

The parser is the one description of the command line: commands, options, which options
take a value, their choices, and which values are paths. Both scripts are written from a
walk of it, so a new option completes without anyone editing a script.

    source <(npuctl completion bash)          # ~/.bashrc
    npuctl completion zsh > ~/.zfunc/_npuctl   # with ~/.zfunc in $fpath before compinit
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

PATH_METAVARS = ("FILE", "PATH", "OUT")  # a value with one of these metavars is a path


@dataclass(slots=True)
class Command:
    """A parser and its place in the command tree (`()` for npuctl itself, `("cache", "ls")`)."""

    path: tuple[str, ...]
    parser: argparse.ArgumentParser
    help: str = ""
    options: list[argparse.Action] = field(default_factory=list)
    positionals: list[argparse.Action] = field(default_factory=list)
    subcommands: list["Command"] = field(default_factory=list)

    def all(self) -> list["Command"]:
        """This command and every command below it, depth first."""
        return [self, *(c for sub in self.subcommands for c in sub.all())]


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help: str = "") -> Command:
    """The command tree of `parser`; options whose help is SUPPRESSed are left out."""
    cmd = Command(path, parser, help)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            cmd.subcommands += [walk(sub, (*path, name), helps.get(name, "")) for name, sub in action.choices.items()]
        elif action.help == argparse.SUPPRESS:
            continue
        elif action.option_strings:
            cmd.options.append(action)
        else:
            cmd.positionals.append(action)
    return cmd


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def is_path(action: argparse.Action) -> bool:
    return action.metavar in PATH_METAVARS


def _words(values) -> str:
    return " ".join(str(v) for v in values)


# -- bash ---------------------------------------------------------------------------------------

def bash_script(parser: argparse.ArgumentParser, prog: str = "npuctl") -> str:
    """A bash completion script: `_npuctl` for `complete -F`, with a table per command."""
    root = walk(parser)
    fn = "_" + prog.replace("-", "_")
    subs, opts, values, choices, paths, positional = [], [], [], [], [], []
    for cmd in root.all():
        key = shlex.quote(" ".join(cmd.path))
        if cmd.subcommands:
            subs.append(f"        {key}) echo {shlex.quote(_words(c.path[-1] for c in cmd.subcommands))} ;;")
        opts.append(f"        {key}) echo {shlex.quote(_words(s for a in cmd.options for s in a.option_strings))} ;;")
        for action in cmd.options:
            if not takes_value(action):
                continue
            pattern = "|".join(shlex.quote(f"{' '.join(cmd.path)}|{s}") for s in action.option_strings)
            values.append(f"        {pattern}) return 0 ;;")
            if action.choices:
                choices.append(f"        {pattern}) echo {shlex.quote(_words(action.choices))} ;;")
            elif is_path(action):
                paths.append(f"        {pattern}) return 0 ;;")
        for action in cmd.positionals[:1]:  # the first positional: what follows the command
            if action.choices:
                positional.append(f"        {key}) COMPREPLY=($(compgen -W {shlex.quote(_words(action.choices))}"
                                  ' -- "$cur")) ;;')
            elif is_path(action):
                positional.append(f'        {key}) COMPREPLY=($(compgen -f -- "$cur")) ;;')

    def table(name: str, rows: list[str], default: str) -> str:
        return "\n".join([f"{fn}_{name}() {{", '    case "$1" in', *rows, f"        *) {default} ;;",
                          "    esac", "}"])

    return "\n".join([
        f"# bash completion for {prog}, generated from its argparse parser by `{prog} completion bash`.",
        table("subcommands", subs, ":"),
        table("options", opts, ":"),
        table("takes_value", values, "return 1"),
        table("choices", choices, ":"),
        table("is_path", paths, "return 1"),
        table("positional", positional, ":"),
        f"""{fn}() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" path="" word i skip=0
    COMPREPLY=()
    # the command path so far ("cache ls"), skipping options and the values they take
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${{COMP_WORDS[i]}}"
        if ((skip)); then skip=0; continue; fi
        if [[ $word == -* ]]; then
            {fn}_takes_value "$path|$word" && skip=1
            continue
        fi
        if [[ " $({fn}_subcommands "$path") " == *" $word "* ]]; then
            path="${{path:+$path }}$word"
        fi
    done
    if ((COMP_CWORD > 1)) && [[ $prev == -* ]] && {fn}_takes_value "$path|$prev"; then
        local values
        values="$({fn}_choices "$path|$prev")"
        if [[ -n $values ]]; then
            COMPREPLY=($(compgen -W "$values" -- "$cur"))
        elif {fn}_is_path "$path|$prev"; then
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
        return 0
    fi
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$({fn}_options "$path")" -- "$cur"))
        return 0
    fi
    local subcommands
    subcommands="$({fn}_subcommands "$path")"
    if [[ -n $subcommands ]]; then
        COMPREPLY=($(compgen -W "$subcommands" -- "$cur"))
        return 0
    fi
    {fn}_positional "$path"
    return 0
}}
complete -F {fn} {prog}
"""])


# -- zsh ----------------------------------------------------------------------------------------

def _zsh_escape(text: str) -> str:
    """Text inside an _arguments spec's [description]: no brackets, colons or quotes."""
    return " ".join(text.replace("[", "(").replace("]", ")").replace(":", " -").replace("'", "").split())


def _zsh_action(action: argparse.Action) -> str:
    if action.choices:
        return f"({' '.join(str(c) for c in action.choices)})"
    return "_files" if is_path(action) else " "


def _zsh_specs(cmd: Command) -> list[str]:
    specs = []
    for action in cmd.options:
        desc = _zsh_escape(action.help or "")
        many = "*" if isinstance(action, (argparse._AppendAction, argparse._CountAction)) else ""
        value = f":{_zsh_escape(action.metavar or action.dest)}:{_zsh_action(action)}" if takes_value(action) else ""
        names = action.option_strings
        if len(names) == 1:
            specs.append(f"'{many}{names[0]}[{desc}]{value}'")
        else:
            exclusive = "" if many else f"({' '.join(names)})"
            specs.append(f"'{exclusive}'{many}{{{','.join(names)}}}'[{desc}]{value}'")
    if cmd.subcommands:
        specs += ["'1:command:->command'", "'*::argument:->argument'"]
    else:
        for i, action in enumerate(cmd.positionals, start=1):
            repeat = "*" if action.nargs in ("*", "+") else str(i)
            specs.append(f"'{repeat}:{_zsh_escape(action.metavar or action.dest)}:{_zsh_action(action)}'")
    return specs


def zsh_script(parser: argparse.ArgumentParser, prog: str = "npuctl") -> str:
    """A zsh completion function (`#compdef npuctl`): `_arguments` per command, with the
    commands and their one-line help for `_describe`."""
    root = walk(parser)
    base = "_" + prog.replace("-", "_")
    out = [f"#compdef {prog}", f"# zsh completion for {prog}, generated from its argparse parser by "
                               f"`{prog} completion zsh`.", ""]
    for cmd in root.all():
        name = "_".join((base, *cmd.path)).replace("-", "_")
        body = [f"{name}() {{", "    local curcontext=$curcontext state line", "    typeset -A opt_args",
                "    _arguments -C -s \\"]
        body += [f"        {spec} \\" for spec in _zsh_specs(cmd)]
        body[-1] = body[-1].rstrip(" \\")
        if cmd.subcommands:
            described = " ".join(shlex.quote(f"{c.path[-1]}:{_zsh_escape(c.help)}") for c in cmd.subcommands)
            cases = " ".join(f"{c.path[-1]}) {'_'.join((base, *c.path)).replace('-', '_')} ;;"
                             for c in cmd.subcommands)
            body += ["    case $state in",
                     f"        command) local -a commands; commands=({described}); _describe command commands ;;",
                     f"        argument) case $line[1] in {cases} esac ;;",
                     "    esac"]
        body.append("}")
        out += body + [""]
    out.append(f'{base} "$@"')
    return "\n".join(out) + "\n"
