"""speculation"""
