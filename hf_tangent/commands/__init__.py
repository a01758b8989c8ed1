"""`hf-tangent` subcommands: one module each, with a `<name>_command_parser(subparsers)` that owns
exactly the options the command uses and a `<name>_command(args)` that calls the library."""
