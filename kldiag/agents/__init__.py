"""kldiag for coding agents: read-only tools over kldiag's JSON contracts, and the MCP server that serves them.

    from kldiag.agents import Workspace, tools
    ws = Workspace(["runs"])
    tools.diagnose(ws, "my_run")            # the "diagnosis" of `kldiag analyze runs/my_run --json`

`kldiag mcp [--root DIR ...]` serves the same functions over MCP's stdio transport (docs/agents.md).
Runs are named by path, absolute or relative to a root; a path that resolves (symlinks and `..`
followed) outside every root is refused. Every list is paged (offset, limit) and every result
bounded in size (kldiag.agents.paging).
"""

from kldiag.agents.workspace import Workspace

__all__ = ["Workspace"]
