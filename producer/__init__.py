"""rollstream.producer"""
