"""boost"""
