"""SPACE as an MCP server (`space mcp`): the tools in `tools`, their transports in `server`."""
