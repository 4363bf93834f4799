"""The runtime layer: the manifest (the contract between the export and its users), decoders that run exported
programs, XNNPACK's options. Imports no torch at module level, so it runs where torch does not."""
