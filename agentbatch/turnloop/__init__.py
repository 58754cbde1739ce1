"""What both engines share above the core: compiling a batch into its runtime, validating it,
sending one model turn and running its tools (the loop's IO, written once), and the handle a
user holds.
"""
