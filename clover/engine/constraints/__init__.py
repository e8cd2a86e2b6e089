"""What bounds a request's output: `grammar` (a JSON Schema or a tool call), `thinking` (a thinking budget),
`repetition` (DRY's penalty and the loop guard), `form` (decision mode's forms: a schema's slots)."""
