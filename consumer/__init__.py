"""rollstream.consumer"""
