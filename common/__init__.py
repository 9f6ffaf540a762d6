"""rollstream.common: the data model, wire codec and miles interop shared by every component."""
