"""rollstream.broker"""
