"""speculation/drafters"""
