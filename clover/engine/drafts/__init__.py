"""Where exact mode's drafts come from and how many pay: `lookup` (copied from the request's context),
`draft_memory` (copied from earlier answers), `drafting` (how many drafts to verify, from the acceptance seen) with
`cost` (how long a forward of so many rows and tokens takes on this runner)."""
